"""streamrl.reshard"""
