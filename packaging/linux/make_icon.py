"""Draw SpecDeck's application icon (assets/icons/specdeck.png, 256x256) with Qt: a rounded
card with three rising bars (drafted tokens) and a tick (verified), and the Windows icon
(assets/icons/specdeck.ico, 48x48, through Qt's ICO writer) for the installer and shortcuts. Run
once; the files are kept."""

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
    icons = Path(__file__).resolve().parents[2] / "assets" / "icons"
    icons.mkdir(parents=True, exist_ok=True)
    image = draw()
    for out, picture in ((icons / "specdeck.png", image), (icons / "specdeck.ico", image.scaled(48, 48, Qt.AspectRatioMode.KeepAspectRatio, Qt.TransformationMode.SmoothTransformation))):
        if not picture.save(str(out)):
            sys.exit(f"could not write {out}")
        print(out)
