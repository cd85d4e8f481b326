"""ckptless.mirror"""
