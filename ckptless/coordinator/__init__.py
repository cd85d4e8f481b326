"""ckptless.coordinator"""
