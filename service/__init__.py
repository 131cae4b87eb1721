"""relserve.service"""
