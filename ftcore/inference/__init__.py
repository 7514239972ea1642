"""Inference apart from the commands that run it: decoding under any layout, exact-match accuracy."""
