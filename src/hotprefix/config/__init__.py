"""Configuration: the frozen dataclasses that hold every default (``sections``) and the command
line's flags built from them (``flags``). Imports nothing heavy."""
