"""plait.models"""
