"""genai"""
