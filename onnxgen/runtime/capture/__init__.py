"""runtime/capture"""
