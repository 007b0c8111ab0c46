"""streamrl.stages"""
