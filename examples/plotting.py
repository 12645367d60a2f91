"""matplotlib for the examples that save a PNG (kept optional: requirements-examples.txt)."""


def require_pyplot(script: str):
    """matplotlib.pyplot on the headless Agg backend, or exit with how to install it."""
    try:
        import matplotlib
    except ImportError:
        raise SystemExit(f"{script} saves its plot with matplotlib, which is not installed; "
                         "install it with: pip install -r requirements-examples.txt")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt
