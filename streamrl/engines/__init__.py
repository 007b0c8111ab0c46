"""streamrl.engines"""
