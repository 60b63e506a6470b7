"""The SDK's version, in a module of its own so that client.py need not import the package."""

__version__ = "0.1.0"
