"""The wire vocabulary: msgspec Structs, one module per channel.

This is the bottom floor: it imports no transport and no torch.
"""
