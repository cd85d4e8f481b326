"""ckptless.recovery"""
