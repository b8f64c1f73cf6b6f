from django.urls import path

from dipaco_web import views

app_name = "dipaco_web"

urlpatterns = [
    path("", views.landing, name="landing"),
]
