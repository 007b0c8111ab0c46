"""streamrl.rewards"""
