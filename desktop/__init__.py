"""SpecDeck's desktop window (PySide6 + pyqtgraph). It depends on ``backends``, never the reverse.

The window itself is built in a later step; until then ``specdeck chat`` is the main program.
"""
