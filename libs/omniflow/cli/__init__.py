"""The ``omniflow`` command line."""
