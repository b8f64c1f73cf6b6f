from django.urls import path

from dipaco_web import views

app_name = "dipaco_web"

urlpatterns = [
    path("", views.runs, name="runs"),
    path("live/runs/", views.runs_live, name="runs-live"),
    path("runs/<int:run_id>/", views.run, name="run"),
    path("runs/<int:run_id>/live/", views.run_live, name="run-live"),
    path("runs/<int:run_id>/actions/<slug:action>/", views.run_action, name="run-action"),
    path("workers/", views.workers, name="workers"),
    path("workers/live/", views.workers_live, name="workers-live"),
    path("login/", views.login, name="login"),
    path("logout/", views.logout, name="logout"),
]
