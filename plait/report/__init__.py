"""plait.report"""
