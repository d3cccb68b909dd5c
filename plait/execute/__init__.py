"""plait.execute"""
