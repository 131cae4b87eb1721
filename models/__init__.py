"""relserve.models"""
