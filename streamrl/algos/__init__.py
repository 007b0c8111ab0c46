"""streamrl.algos"""
