"""Draw SpecDeck's application icon (assets/icons/specdeck.png, 256x256) with Qt: a rounded
card with three rising bars (drafted tokens) and a tick (verified). Run once; the PNG is kept."""

from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

from PySide6.QtCore import QPointF, QRectF, Qt  # noqa: E402
from PySide6.QtGui import QColor, QGuiApplication, QImage, QPainter, QPainterPath, QPen  # noqa: E402


def draw(size: int = 256) -> QImage:
    image = QImage(size, size, QImage.Format.Format_ARGB32)
    image.fill(Qt.GlobalColor.transparent)
    p = QPainter(image)
    p.setRenderHint(QPainter.RenderHint.Antialiasing)
    card = QPainterPath()
    card.addRoundedRect(QRectF(12, 12, size - 24, size - 24), 40, 40)
    p.fillPath(card, QColor(33, 47, 77))
    for i, height in enumerate((70, 110, 150)):
        p.fillRect(QRectF(48 + i * 52, 200 - height, 36, height), QColor(60, 140, 230))
    p.setPen(QPen(QColor(120, 220, 140), 18, Qt.PenStyle.SolidLine, Qt.PenCapStyle.RoundCap, Qt.PenJoinStyle.RoundJoin))
    p.drawPolyline([QPointF(150, 60), QPointF(175, 85), QPointF(218, 38)])
    p.end()
    return image


if __name__ == "__main__":
    app = QGuiApplication(sys.argv[:1])
    out = Path(__file__).resolve().parents[2] / "assets" / "icons" / "specdeck.png"
    out.parent.mkdir(parents=True, exist_ok=True)
    draw().save(str(out))
    print(out)
