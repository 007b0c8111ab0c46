"""streamrl.metrics"""
