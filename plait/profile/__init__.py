"""plait.profile"""
