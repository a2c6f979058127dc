"""The package version, on a floor of its own: every layer may import it."""

__version__ = "0.2.0"
