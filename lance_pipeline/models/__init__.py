"""Model handling, one room: which files each declared model needs (``needs``), the Hub cache and local copies
(``hub_cache``), one loaded object per process for models several stages share (``shared``), and the device rule
every command shares (``devices``). It imports no other room of the project, so every layer may use it."""
