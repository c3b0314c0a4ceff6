"""Model definitions built only from rlkernel ops, shared by every engine integration."""
from .decoder import ROW_SEGMENTS, DecoderConfig, StrictDecoder, pack_sequences

__all__ = ["ROW_SEGMENTS", "DecoderConfig", "StrictDecoder", "pack_sequences"]
