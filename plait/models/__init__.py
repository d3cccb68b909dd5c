"""Reference GPT-2-style and Llama-style decoders built from a ModelSpec (used by check, train, demo, tests)."""

from plait.models.transformer import (
    Attention,
    FeedForward,
    PositionEmbedding,
    RMSNorm,
    Transformer,
    TransformerBlock,
    build_model,
    initial_state_dict,
    initial_tensor,
)

__all__ = [
    "Attention", "FeedForward", "PositionEmbedding", "RMSNorm", "Transformer", "TransformerBlock",
    "build_model", "initial_state_dict", "initial_tensor",
]
