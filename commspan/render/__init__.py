"""Views of analysis results: text for the terminal (JSON comes from the results' ``to_dict``)."""

__all__: list[str] = []
