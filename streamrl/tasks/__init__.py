"""streamrl.tasks"""
