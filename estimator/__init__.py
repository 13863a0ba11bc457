"""Offline memory and communication estimator for Megatron training. Imports no torch and no megatron."""
