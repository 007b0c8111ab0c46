"""streamrl.dock"""
