"""Example training runs for mpjax (importable so tests can run them at tiny sizes)."""
