"""streamrl.models"""
