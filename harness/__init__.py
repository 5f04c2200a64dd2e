"""brigade: a config-driven benchmark harness for parallel training strategies."""
__version__ = "0.1.0"
