"""relserve.loadtest"""
