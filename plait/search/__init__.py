"""plait.search"""
