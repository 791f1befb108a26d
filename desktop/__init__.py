"""SpecDeck's desktop window (PySide6 + pyqtgraph). It depends on ``backends``, never the reverse."""
