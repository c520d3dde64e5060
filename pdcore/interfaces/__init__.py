"""Small ABCs and frozen dataclasses every plugin implements against."""
