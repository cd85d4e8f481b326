"""ckptless.goodput"""
