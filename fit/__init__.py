"""Turns parsed traces into exact per-op activation formulas (formula sets)."""
