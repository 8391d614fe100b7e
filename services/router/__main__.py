from services.router.main import main

main()
