"""Side-by-side benchmarks (``python -m cukv bench ...``). PyTorch is used only here, as the peer."""


def peer_torch():
    """(torch module, None) when the peers can run, else (None, reason)."""
    try:
        import torch
    except Exception as e:  # noqa: BLE001 - peers are optional
        return None, f"torch not importable ({type(e).__name__}: {str(e)[:100]})"
    try:
        if not torch.cuda.is_available():
            return None, "torch sees no CUDA device"
        from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: F401 - torch >= 2.3
    except Exception as e:  # noqa: BLE001
        return None, f"torch {getattr(torch, '__version__', '?')} lacks torch.nn.attention.sdpa_kernel ({e})"
    return torch, None
