"""Checkpoints: store.py saves and loads them atomically (and resolves `latest`), files.py verifies
the files before they are published, resume.py says what a checkpoint holds and puts a run back
exactly where it was."""
