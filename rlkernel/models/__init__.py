"""Model definitions built only from rlkernel ops, shared by every engine integration."""
from .decoder import DecoderConfig, StrictDecoder, pack_sequences

__all__ = ["DecoderConfig", "StrictDecoder", "pack_sequences"]
