"""The command line: `macinfer serve | generate | chat | bench | models` (click), its shared
options and the chat REPL. The top layer: may import every other package."""
