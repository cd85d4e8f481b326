"""ckptless.state"""
