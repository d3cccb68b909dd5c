"""plait.cost"""
