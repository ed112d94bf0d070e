"""runtime/shapes"""
