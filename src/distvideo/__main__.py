from distvideo.cli.main import main

raise SystemExit(main())
