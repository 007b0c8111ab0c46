"""streamrl.runtime"""
