"""ckptless.snapshot"""
