"""plait.train"""
