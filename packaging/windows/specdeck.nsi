; SpecDeck's Windows installer (NSIS 3, Modern UI 2): a per-user install (no administrator
; rights: %LOCALAPPDATA%\Programs\SpecDeck), Start-menu and desktop shortcuts, an entry in
; "Installed apps", and an uninstaller that keeps the user's conversations, settings and models
; unless they tick the box that removes them (silently: `uninstall.exe /S /REMOVEDATA`).
;
;   makensis -DVERSION=0.1.0 -DPAYLOAD=dist\specdeck -DOUTFILE=dist\SpecDeck-0.1.0-setup.exe packaging\windows\specdeck.nsi
;
; PAYLOAD is the PyInstaller one-folder app (packaging/frozen/specdeck.spec, built on Windows by
; .github/workflows/windows.yml). What SpecDeck writes while it runs lives outside the install
; folder, where platformdirs and Qt put it: %LOCALAPPDATA%\specdeck (conversations, models from
; the Hub, trained heads, derived models, measurements) and HKCU\Software\SpecDeck (window
; settings). Those are what the uninstaller keeps by default.

Unicode true
!ifdef TARGET  ; -DTARGET=amd64-unicode: a 64-bit installer (Debian's NSIS has the stubs; the official one does not)
  Target ${TARGET}
!endif
ManifestDPIAware true
SetCompressor /SOLID lzma

!ifndef VERSION
  !error "give -DVERSION=x.y.z"
!endif
!ifndef PAYLOAD
  !error "give -DPAYLOAD=folder (the frozen app)"
!endif
!ifndef OUTFILE
  !define OUTFILE "SpecDeck-${VERSION}-setup.exe"
!endif

!define APP "SpecDeck"
!define EXE "specdeck.exe"
!define UNINST_KEY "Software\Microsoft\Windows\CurrentVersion\Uninstall\${APP}"
!define USER_DATA "$LOCALAPPDATA\specdeck"
!define USER_SETTINGS "Software\SpecDeck"

!include "MUI2.nsh"
!include "FileFunc.nsh"
!include "LogicLib.nsh"
!include "Sections.nsh"

Name "${APP}"
OutFile "${OUTFILE}"
RequestExecutionLevel user
InstallDir "$LOCALAPPDATA\Programs\${APP}"
InstallDirRegKey HKCU "${UNINST_KEY}" "InstallLocation"
BrandingText "${APP} ${VERSION}"
VIProductVersion "${VERSION}.0"
VIAddVersionKey "ProductName" "${APP}"
VIAddVersionKey "ProductVersion" "${VERSION}"
VIAddVersionKey "FileVersion" "${VERSION}"
VIAddVersionKey "FileDescription" "${APP} installer"
VIAddVersionKey "LegalCopyright" "SpecDeck contributors, Apache-2.0"

!define MUI_ICON "..\..\assets\icons\specdeck.ico"
!define MUI_UNICON "..\..\assets\icons\specdeck.ico"
!define MUI_ABORTWARNING
!define MUI_FINISHPAGE_RUN "$INSTDIR\${EXE}"
!define MUI_FINISHPAGE_RUN_TEXT "Start ${APP}"

!insertmacro MUI_PAGE_WELCOME
!insertmacro MUI_PAGE_LICENSE "..\LICENSE"
!insertmacro MUI_PAGE_DIRECTORY
!insertmacro MUI_PAGE_INSTFILES
!insertmacro MUI_PAGE_FINISH

!insertmacro MUI_UNPAGE_CONFIRM
!insertmacro MUI_UNPAGE_COMPONENTS
!insertmacro MUI_UNPAGE_INSTFILES

!insertmacro MUI_LANGUAGE "English"

Section "${APP}" SecApp
  SectionIn RO
  SetOutPath "$INSTDIR"
  RMDir /r "$INSTDIR\_internal"  ; an update replaces the program, never the user's files (kept elsewhere)
  File /r "${PAYLOAD}\*.*"
  WriteUninstaller "$INSTDIR\uninstall.exe"

  CreateDirectory "$SMPROGRAMS\${APP}"
  CreateShortCut "$SMPROGRAMS\${APP}\${APP}.lnk" "$INSTDIR\${EXE}" "" "$INSTDIR\${EXE}" 0
  CreateShortCut "$SMPROGRAMS\${APP}\Uninstall ${APP}.lnk" "$INSTDIR\uninstall.exe"
  CreateShortCut "$DESKTOP\${APP}.lnk" "$INSTDIR\${EXE}" "" "$INSTDIR\${EXE}" 0

  WriteRegStr HKCU "${UNINST_KEY}" "DisplayName" "${APP}"
  WriteRegStr HKCU "${UNINST_KEY}" "DisplayVersion" "${VERSION}"
  WriteRegStr HKCU "${UNINST_KEY}" "Publisher" "SpecDeck contributors"
  WriteRegStr HKCU "${UNINST_KEY}" "DisplayIcon" "$INSTDIR\${EXE}"
  WriteRegStr HKCU "${UNINST_KEY}" "InstallLocation" "$INSTDIR"
  WriteRegStr HKCU "${UNINST_KEY}" "UninstallString" '"$INSTDIR\uninstall.exe"'
  WriteRegStr HKCU "${UNINST_KEY}" "QuietUninstallString" '"$INSTDIR\uninstall.exe" /S'
  WriteRegDWORD HKCU "${UNINST_KEY}" "NoModify" 1
  WriteRegDWORD HKCU "${UNINST_KEY}" "NoRepair" 1
  ${GetSize} "$INSTDIR" "/S=0K" $0 $1 $2
  WriteRegDWORD HKCU "${UNINST_KEY}" "EstimatedSize" $0
SectionEnd

Section "un.${APP} (the program)" UnSecApp
  SectionIn RO
  Delete "$DESKTOP\${APP}.lnk"
  RMDir /r "$SMPROGRAMS\${APP}"
  RMDir /r "$INSTDIR\_internal"
  Delete "$INSTDIR\${EXE}"
  Delete "$INSTDIR\uninstall.exe"
  RMDir "$INSTDIR"  ; only when empty: nothing the user put there goes
  DeleteRegKey HKCU "${UNINST_KEY}"
SectionEnd

; Off unless ticked: conversations, downloaded and derived models, trained heads and settings.
Section /o "un.My conversations, models and settings" UnSecData
  RMDir /r "${USER_DATA}"
  DeleteRegKey HKCU "${USER_SETTINGS}"
SectionEnd

; `/REMOVEDATA` ticks that box for a silent uninstall (`uninstall.exe /S /REMOVEDATA`).
Function un.onInit
  ${un.GetParameters} $R0
  ClearErrors
  ${un.GetOptions} $R0 "/REMOVEDATA" $R1
  ${IfNot} ${Errors}
    !insertmacro SelectSection ${UnSecData}
  ${EndIf}
FunctionEnd

!insertmacro MUI_UNFUNCTION_DESCRIPTION_BEGIN
  !insertmacro MUI_DESCRIPTION_TEXT ${UnSecApp} "The program, its shortcuts and its entry in Installed apps."
  !insertmacro MUI_DESCRIPTION_TEXT ${UnSecData} "Also delete ${USER_DATA} (conversations, models from the Hub, trained heads, measurements) and the window settings. Left unticked, they stay for a later install."
!insertmacro MUI_UNFUNCTION_DESCRIPTION_END
